"""Recall and false positives of the export's de-identification (glm5_jax/data/deidentify.py).

    python bench/deidentify_recall.py [--seed 0] [--per-kind 20] [--stdlib-files 0] [--show]

Positives: a planted set, `--per-kind` generated secrets of each kind below (checksummed card numbers
and IBANs, valid SSNs, random keys of each provider's shape, PEM blocks, passwords, phones in many
formats, ...), each in one of several surroundings (prose, code, JSON, YAML, shell, log lines).
A planted secret counts as caught when neither it nor any of its pieces of 4+ characters that are
not in the surrounding text is left in the output.

Negatives: ordinary strings a naive regex would flag (version strings, named and bare hex digests,
UUIDs, dates, timestamps, ISBNs, tracebacks, numbers, Luhn- and IBAN-invalid lookalikes, invalid
SSNs, code and prose about passwords and tokens, tokenizer configs, paths, URLs), and the Python
standard library's own sources (every .py file under Path(os.__file__).parent outside test folders
and site-packages; `--stdlib-files N` reads the first N, 0 all). A replacement in a negative is a
false positive, except e-mail and IP addresses in the standard library, which are real addresses
(counted and shown apart). --show prints every miss and every false positive.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import re
import string
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from glm5_jax.data.deidentify import IBAN_LENGTHS, Deidentifier, luhn_valid  # noqa: E402

ALNUM = string.ascii_letters + string.digits


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="seed of the planted set")
    parser.add_argument("--per-kind", type=int, default=20, help="planted examples per kind")
    parser.add_argument("--stdlib-files", type=int, default=0,
                        help="read the first N standard-library files (sorted by path); 0: all")
    parser.add_argument("--corpus", action="append", default=[], metavar="DIR",
                        help="more negatives: every .py/.md/.rst/.txt file under DIR (repeatable)")
    parser.add_argument("--show", action="store_true", help="print every miss and false positive")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the figures here")
    return parser.parse_args(argv)


# ---------------------------------------------------------------- planted secrets
def _chars(rng, alphabet, n):
    return "".join(rng.choice(alphabet) for _ in range(n))


def _digits(rng, n):
    return _chars(rng, string.digits, n)


def _card(rng):
    """(a Luhn-valid card number of a network, its print groups)."""
    prefix, length, groups = rng.choice([
        ("4", 16, (4, 4, 4, 4)), ("5" + rng.choice("12345"), 16, (4, 4, 4, 4)), ("2221", 16, (4, 4, 4, 4)),
        ("3" + rng.choice("47"), 15, (4, 6, 5)), ("6011", 16, (4, 4, 4, 4)),
        (str(rng.randint(3528, 3589)), 16, (4, 4, 4, 4)), ("36", 14, (4, 6, 4)), ("62", 16, (4, 4, 4, 4)),
        ("4", 19, (4, 4, 4, 4, 3))])
    body = prefix + _digits(rng, length - len(prefix) - 1)
    digits = next(body + d for d in string.digits if luhn_valid(body + d))
    starts = [sum(groups[:i]) for i in range(len(groups))]
    return digits, [digits[start:start + size] for start, size in zip(starts, groups, strict=True)]


def _iban(rng):
    country = rng.choice(["DE", "GB", "FR", "ES", "IT", "NL", "BE", "CH", "AT", "PL", "SE", "NO", "IE", "PT"])
    letters = 4 if country in ("GB", "IE", "NL") else 0  # a bank code of letters
    bban = _chars(rng, string.ascii_uppercase, letters) + _digits(rng, IBAN_LENGTHS[country] - 4 - letters)
    check = 98 - int("".join(str(int(c, 36)) for c in bban + country + "00")) % 97
    return f"{country}{check:02d}{bban}"


def _nanp(rng):
    """(area code, exchange, line) of a valid North American number."""
    while True:
        area = f"{rng.randint(2, 9)}{rng.randint(0, 8)}{rng.randint(0, 9)}"
        exchange = f"{rng.randint(2, 9)}{rng.randint(0, 9)}{rng.randint(0, 9)}"
        if area[1:] != "11" and exchange[1:] != "11":
            return area, exchange, _digits(rng, 4)


def _password(rng):
    words = ["correct", "horse", "battery", "staple", "lemon", "river", "cloud"]
    return rng.choice([
        lambda: rng.choice(["hunter", "dragon", "sunshine", "monkey", "letmein"]) + str(rng.randint(1, 999)),
        lambda: _chars(rng, ALNUM + "!@#$%^*", rng.randint(8, 16)),
        lambda: "-".join(rng.sample(words, 4)),
        lambda: "P@ssw0rd" + rng.choice("!?#") + str(rng.randint(10, 99)),
        lambda: str(rng.randint(100000, 99999999)),
    ])()


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _plant_card(style):
    def plant(rng):
        digits, parts = _card(rng)
        text = {"plain": digits, "spaced": " ".join(parts), "dashed": "-".join(parts)}[style]
        return text, [text]
    return plant


def _plant_ssn(rng):
    area = rng.choice([a for a in range(1, 900) if a != 666])
    area, group, serial = f"{area:03d}", f"{rng.randint(1, 99):02d}", f"{rng.randint(1, 9999):04d}"
    text = rng.choice([f"{area}-{group}-{serial}"] * 3
                      + [f"{area} {group} {serial}", f"SSN {area}{group}{serial}"])
    return text, [f"{area}{group}{serial}" if "SSN" in text else text]


def _plant_iban(rng):
    iban = _iban(rng)
    grouped = " ".join(iban[i:i + 4] for i in range(0, len(iban), 4))
    text = rng.choice([iban, grouped, grouped.lower() if rng.random() < 0.2 else grouped])
    return text, [text]


def _plant_password(rng):
    value = _password(rng)
    template = rng.choice(["password: {}", "password={}", "PASSWORD={}", '"password": "{}"',
                           "db_password = '{}'", "--password {}", "passwd: {}", "Password: {}", "pwd={}",
                           "DB_PASSWORD: {}", "dbPassword: '{}'", 'passphrase = "{}"'])
    return template.format(value), [value]


def _plant_secret_assignment(rng):
    value = _chars(rng, ALNUM, rng.randint(8, 24))
    template = rng.choice(["secret: {}", "api_key={}", "token={}", 'client_secret: "{}"', "API_KEY={}",
                           "auth_token: {}", "x-api-key: {}", "SECRET_KEY = '{}'", '{{"apiKey": "{}"}}',
                           "access_token={}&expires=3600", "GITHUB_TOKEN={}", "secret_key: {}"])
    return template.format(value), [value]


def _plant_pem(rng):
    label = rng.choice(["RSA PRIVATE KEY", "PRIVATE KEY", "EC PRIVATE KEY", "OPENSSH PRIVATE KEY",
                        "ENCRYPTED PRIVATE KEY", "DSA PRIVATE KEY"])
    lines = [base64.b64encode(rng.randbytes(48)).decode() for _ in range(rng.randint(3, 8))]
    lines.append(base64.b64encode(rng.randbytes(rng.randint(5, 40))).decode())
    newline = rng.choice(["\n", "\n", "\\n"])  # "\\n": inside a string literal
    end = "" if rng.random() < 0.15 else f"{newline}-----END {label}-----"  # sometimes cut off
    text = f"-----BEGIN {label}-----{newline}" + newline.join(lines) + end
    return text, [line for line in lines if len(line) >= 8]


def _plant_aws_secret(rng):
    value = rng.choice([_chars(rng, ALNUM + "+/", 40), "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
                        _chars(rng, ALNUM + "+/", 30) + "EXAMPLEKEY"])
    template = rng.choice(["aws_secret_access_key = {}", "AWS_SECRET_ACCESS_KEY={}", "{}", "secret key {}",
                           '"SecretAccessKey": "{}"', "export AWS_SECRET_ACCESS_KEY={}"])
    return template.format(value), [value]


def _plant_key(*makers):
    def plant(rng):
        text = rng.choice(makers)(rng)
        return text, [text]
    return plant


def _jwt(rng):
    header = _b64url(json.dumps({"alg": rng.choice(["HS256", "RS256"]), "typ": "JWT"}).encode())
    claims = {"sub": str(rng.randint(1, 10**6)), "iat": rng.randint(10**9, 2 * 10**9)}
    signature = _b64url(rng.randbytes(rng.choice([0, 16, 32])))  # none (alg "none"), or a MAC
    return f"{header}.{_b64url(json.dumps(claims).encode())}.{signature}"


def _plant_bearer(low, high):
    def plant(rng):
        n = rng.randint(low, high)
        alphabet = string.ascii_lowercase + string.digits if rng.random() < 0.5 else ALNUM + "-._"
        value = _chars(rng, alphabet, n)
        if not any(c.isdigit() for c in value):
            value += str(rng.randint(0, 9))
        template = rng.choice(["Authorization: Bearer {}", "-H 'Authorization: Bearer {}'", "bearer {}",
                               '"Authorization": "Bearer {}"', "Bearer {}", "authorization: bearer {}"])
        return template.format(value), [value]
    return plant


def _plant_url_credentials(rng):
    user, password = _chars(rng, string.ascii_lowercase, 6), _password(rng).replace("@", "").replace("/", "")
    scheme = rng.choice(["postgres", "mysql", "https", "redis", "amqp", "mongodb+srv"])
    return f"{scheme}://{user}:{password}@db{rng.randint(1, 9)}.example.com:5432/app", [f"{user}:{password}"]


def _plant_hex_secret(rng):
    value = _chars(rng, "0123456789abcdef", rng.choice([32, 40, 64]))
    return rng.choice(["session {}", "X-Session-Id: {}", "the key is {}", "{}"]).format(value), [value]


def _phone_formatted(rng):
    a, e, n = _nanp(rng)
    return rng.choice([f"{a}-{e}-{n}", f"({a}) {e}-{n}", f"{a}.{e}.{n}", f"{a} {e} {n}", f"1-{a}-{e}-{n}",
                       f"+1 {a} {e} {n}", f"+1-{a}-{e}-{n}", f"+1 ({a}) {e}-{n}"])


def _phone_bare(rng):
    a, e, n = _nanp(rng)
    return rng.choice([f"{a}{e}{n}", f"{a}{e}{n}", f"1{a}{e}{n}"])


def _phone_international(rng):
    d = lambda k: _digits(rng, k)  # noqa: E731
    return rng.choice([f"+44 20 {d(4)} {d(4)}", f"+49 30 {d(8)}", f"+33 1 {d(2)} {d(2)} {d(2)} {d(2)}",
                       f"+81 3-{d(4)}-{d(4)}", f"+61 2 {d(4)} {d(4)}", f"+91 9{d(4)} {d(5)}",
                       f"+86 138 {d(4)} {d(4)}", f"+4420{d(8)}", f"+34 6{d(2)} {d(3)} {d(3)}"])


def _phone_national(rng):
    d = lambda k: _digits(rng, k)  # noqa: E731
    return rng.choice([f"020 {d(4)} {d(4)}", f"01 {d(2)} {d(2)} {d(2)} {d(2)}", f"030 {d(8)}", f"06-{d(8)}",
                       f"0412 {d(3)} {d(3)}", f"07700 {d(6)}", f"0044 20 {d(4)} {d(4)}"])


def _email(rng):
    lower = string.ascii_lowercase
    return rng.choice([f"{_chars(rng, lower, 5)}.{_chars(rng, lower, 6)}@example.com",
                       f"{_chars(rng, lower, 4)}+tag@mail.example.co.uk",
                       f"{_chars(rng, ALNUM, 8)}@corp-7.org"])


def _ipv6(rng):
    group = lambda: f"{rng.randint(1, 65535):x}"  # noqa: E731
    return rng.choice([":".join(group() for _ in range(8)), f"2001:db8::{group()}:{group()}",
                       f"fe80::{group()}:{rng.randint(1, 255):02x}ff:fe{rng.randint(16, 255):x}:1"])


# kind -> rng -> (the text to plant, the secret pieces that must not survive)
PLANTERS = {
    "email": _plant_key(_email),
    "ipv4": _plant_key(lambda rng: ".".join(str(rng.randint(1, 254)) for _ in range(4))),
    "ipv6": _plant_key(_ipv6),
    "phone_formatted": _plant_key(_phone_formatted),
    "phone_bare_10_digit": _plant_key(_phone_bare),
    "phone_international": _plant_key(_phone_international),
    "phone_national": _plant_key(_phone_national),
    "credit_card_plain": _plant_card("plain"),
    "credit_card_spaced": _plant_card("spaced"),
    "credit_card_dashed": _plant_card("dashed"),
    "ssn": _plant_ssn,
    "iban": _plant_iban,
    "password_assignment": _plant_password,
    "secret_assignment": _plant_secret_assignment,
    "pem_private_key": _plant_pem,
    "aws_access_key_id": _plant_key(lambda rng: rng.choice(["AKIA", "ASIA"])
                                    + _chars(rng, string.ascii_uppercase + "234567", 16)),
    "aws_secret_key": _plant_aws_secret,
    "stripe_key": _plant_key(lambda rng: rng.choice(["sk_live_", "sk_test_", "rk_live_", "rk_test_"])
                             + _chars(rng, ALNUM, rng.choice([24, 34, 99]))),
    "github_token": _plant_key(lambda rng: "ghp_" + _chars(rng, ALNUM, 36),
                               lambda rng: "gho_" + _chars(rng, ALNUM, 36),
                               lambda rng: f"github_pat_{_chars(rng, ALNUM, 22)}_{_chars(rng, ALNUM, 59)}"),
    "slack_token": _plant_key(lambda rng: f"{rng.choice(['xoxb', 'xoxp', 'xoxa', 'xoxs'])}-"
                                          f"{_digits(rng, 12)}-{_digits(rng, 13)}-{_chars(rng, ALNUM, 24)}"),
    "google_api_key": _plant_key(lambda rng: "AIza" + _chars(rng, ALNUM + "_-", 35)),
    "openai_key": _plant_key(lambda rng: rng.choice(["sk-", "sk-proj-", "sk-ant-api03-"])
                             + _chars(rng, ALNUM, rng.choice([20, 48, 64]))),
    "jwt": _plant_key(_jwt),
    "bearer_token_short": _plant_bearer(4, 15),
    "bearer_token_long": _plant_bearer(20, 80),
    "url_credentials": _plant_url_credentials,
    "hex_secret": _plant_hex_secret,
}
KINDS = tuple(PLANTERS)
SURROUNDINGS = ("{}", "Hi, my details: {}. Thanks!", "    config = '{}'", '{{"note": "{}"}}',
                "- {}\n- next item", "2024-05-01 12:00:01 INFO request from user: {} (ok)",
                'export VALUE="{}"', "> {}\n\nCan you check this?", "Here it is:\n```\n{}\n```",
                "user said: {}, then left")


def planted_set(seed: int, per_kind: int) -> list[tuple[str, str, list[str]]]:
    """(kind, text, secret pieces) for every planted example."""
    rng, examples = random.Random(seed), []
    for kind, plant in PLANTERS.items():
        for i in range(per_kind):
            text, secrets = plant(rng)
            examples.append((kind, SURROUNDINGS[i % len(SURROUNDINGS)].format(text), secrets))
    return examples


def caught(output: str, text: str, secrets: list[str]) -> bool:
    """Whether no secret, nor any 4+ character piece of one that is not in the surroundings, is left."""
    if any(secret in output for secret in secrets):
        return False
    pieces = {p for secret in secrets for p in re.split(r"[^A-Za-z0-9]+", secret) if len(p) >= 4}
    context = text
    for secret in secrets:
        context = context.replace(secret, " ")
    return not any(piece in output for piece in pieces if piece not in context)


# ---------------------------------------------------------------- negatives
def _luhn_invalid(rng):
    digits, parts = _card(rng)
    wrong = digits[:-1] + str((int(digits[-1]) + rng.randint(1, 9)) % 10)
    return rng.choice([wrong, " ".join(wrong[i:i + 4] for i in range(0, len(wrong), 4))])


def _iban_invalid(rng):
    iban = _iban(rng)
    wrong = iban[:4] + iban[4:-1] + str((int(iban[-1]) + rng.randint(1, 9)) % 10)
    return rng.choice([wrong, " ".join(wrong[i:i + 4] for i in range(0, len(wrong), 4))])


def synthetic_negatives(seed: int) -> list[tuple[str, str]]:
    """(category, text) of ordinary strings, at least 10 per category."""
    rng = random.Random(seed + 1)
    hexes = lambda n: _chars(rng, "0123456789abcdef", n)  # noqa: E731
    uuid = lambda: f"{hexes(8)}-{hexes(4)}-4{hexes(3)}-a{hexes(3)}-{hexes(12)}"  # noqa: E731
    categories = {
        "version string": ["Python 3.11.7", "v1.2.3", "version 10.0.19045.2965", "numpy==1.26.4",
                           "jax>=0.4.30", "release 2.4.1.0 is out", "Chrome/120.0.6099.109",
                           "libc 2.35-0ubuntu3.6", "node v20.11.1", "CUDA 12.4.1", "build 10.0.22621.1",
                           "go1.22.3 linux/amd64"],
        "named hex digest": [f"commit {hexes(40)}", f"sha256: {hexes(64)}", f"md5 {hexes(32)}",
                             f"sha256:{hexes(64)}", f"Merge: {hexes(7)} {hexes(7)}", f'"sha1": "{hexes(40)}"',
                             f"integrity sha512-{hexes(40)}", f"git checkout {hexes(12)}",
                             f"digest = '{hexes(64)}'", f"Revision {hexes(40)}", f"etag: \"{hexes(32)}\"",
                             f"object {hexes(40)}"],
        "bare hex digest": [hexes(n) for n in (32, 40, 64, 32, 40, 64, 40, 40, 64, 32)],
        "uuid": [uuid() for _ in range(6)] + [uuid().upper(), f"urn:uuid:{uuid()}", f"request_id={uuid()}",
                                              f'{{"id": "{uuid()}"}}'],
        "date and time": ["2024-01-15", "15/01/2024", "2024-01-15T10:30:00Z", "Jan 15, 2024 10:30:45",
                          "1705312200", "1705312200123", "2024-01-15 10:30:45.123456+00:00", "20240115",
                          "Mon, 15 Jan 2024 10:30:00 GMT", "12:30:45", "2023-W49-3", "1999-12-31 23:59:59"],
        "isbn": ["ISBN 978-0-306-40615-7", "9780306406157", "ISBN 0-306-40615-2", "0306406152",
                 "978-3-16-148410-0", "ISBN-13: 978-1-4028-9462-6", "ISBN 1-56619-909-3", "979-10-90636-07-1",
                 "ISSN 0317-8471", "ISBN 978 0 306 40615 7"],
        "traceback and line numbers": ['File "/usr/lib/python3.11/json/decoder.py", line 337, in decode',
                                       "  at line 1234, column 56", "lines 100-200", "L42-L57",
                                       "src/a.py:8123:17", "error at offset 4096", "line 1044 of 2048",
                                       "#L1205", "stack depth 3000",
                                       "byte 123456789 of the file"],
        "number": ["3.14159265358979", "1,234,567", "6.02214076e23", "12345678901234567890", "0x7fffffff",
                   "2147483647", "4294967295", "x = 1234567890", "1e-10", "100000000", "$1,500.00",
                   "€ 12.345,67",
                   "[10, 20, 30, 40]", "1 2 3 4 5 6 7 8 9 10", "999999999", "0.5551234567"],
        "ten-digit number": ["2718281828", "3141592653", "6022140760", "9007199254", "seed 5489012345",
                             "6553565535", "4815162342", "8675309000", "2023011599", "7777777777"],
        "luhn-invalid card lookalike": [_luhn_invalid(rng) for _ in range(12)],
        "iban-invalid lookalike": [_iban_invalid(rng) for _ in range(12)],
        "invalid ssn": ["000-12-3456", "666-12-3456", "900-12-3456", "123-00-4567", "123-45-0000",
                        "999-99-9999", "666 01 2345", "000 00 0000", "912-34-5678", "987-65-4321"],
        "code about secrets": ["password = getpass.getpass()", "def login(user, password):", "if not token:",
                               "token = tokens.pop(0)", "api_key = os.environ['API_KEY']",
                               "secret = secrets.token_hex(16)", "tokenizer.pad_token = tokenizer.eos_token",
                               "bos_token: '<s>'", "max_tokens: 256",
                               "password_hash = bcrypt.hashpw(pw, salt)",
                               "--token $GITHUB_TOKEN", "Authorization: Bearer $TOKEN",
                               "headers = {'Authorization': f'Bearer {token}'}", "token: str | None = None",
                               "password=password,", "self.token = token", "api_key=api_key", "token = ''",
                               "if token == '(':", "secret_key = settings.SECRET_KEY", "pwd = os.getcwd()",
                               "password: ${DB_PASSWORD}", "api_key: <your-api-key>", "token = self._next()",
                               "for token in tokens:", "eos_token = \"<|endoftext|>\""],
        "prose about secrets": ["The bearer token is sent in the header.", "Enter your password:",
                                "Tokens expire after an hour.", "Password must be at least 8 characters.",
                                "Use a strong passphrase.", "Bearer authentication is described in RFC 6750.",
                                "Your API key is on the settings page.", "The secret: nobody knows.",
                                "Reset the password: click Forgot.", "Token: see below."],
        "identifier and path": ["MyVeryLongClassNameForHTTP2Connections",
                                "compute_the_average_of_all_values_2024",
                                "/usr/lib/python3/dist-packages/SomeModule2Name",
                                "src/glm5_jax/serve/feedback_log.py",
                                "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/",
                                "test_deidentification_replaces_each_kind_and_counts_it",
                                "kernels_pallas/flash_attention_backward_kernel.py",
                                "org.apache.commons.lang3.StringUtils",
                                "C:\\Users\\Public\\Documents\\report2024.docx", "XMLHttpRequestEventTarget"],
        "url and address": ["https://example.org/a/b?x=1&y=2", "http://localhost:8000/v1/chat/completions",
                            "git@github.com:owner/repo.git", "ssh://git@github.com/owner/repo",
                            "https://docs.python.org/3/library/re.html#re.sub", "ftp://ftp.example.com/pub/",
                            "file:///tmp/x.txt", "http://[::1]:8080/", "s3://bucket/path/to/object.parquet",
                            "mailto:?subject=hello"],
    }
    return [(category, text) for category, texts in categories.items() for text in texts]


def stdlib_files(limit: int) -> list[Path]:
    root = Path(os.__file__).parent
    skipped = {"test", "tests", "idle_test", "site-packages", "__pycache__"}
    files = sorted(p for p in root.rglob("*.py") if not skipped & set(p.relative_to(root).parts))
    return files[:limit] if limit else files


def corpus_files(directory: str) -> list[Path]:
    return sorted(p for pattern in ("*.py", "*.md", "*.rst", "*.txt") for p in Path(directory).rglob(pattern)
                  if "__pycache__" not in p.parts and p.is_file())


# ---------------------------------------------------------------- measure
ADDRESS_WORDS = re.compile(r"(?i)(?<![a-z])ip|addr|host|inet|socket|netmask|network|interface|proxy|server"
                           r"|127\.0\.0\.1|0\.0\.0\.0|255\.255\.|192\.0\.2\.|2001:(?:db8)?:|fe80::")


def real_address(kind: str, line: str) -> bool:
    """Whether a corpus line's replacement of `kind` is a real address: every e-mail address; IP
    addresses on lines that speak of addresses, hosts, sockets or networks."""
    return kind == "email" or (kind in ("ipv4", "ipv6") and bool(ADDRESS_WORDS.search(line)))


def scan(files: list[Path]) -> dict:
    """Every line of `files` de-identified: false positives and real addresses by kind, lines, bytes,
    and one example line per replacement."""
    result = {"files": len(files), "lines": 0, "bytes": 0, "false_positives": Counter(), "real": Counter(),
              "examples": []}
    for path in files:
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            result["lines"] += 1
            result["bytes"] += len(line) + 1
            deidentifier = Deidentifier()
            if deidentifier.text(line) == line:
                continue
            for kind, count in deidentifier.counts.items():
                real = real_address(kind, line)
                result["real" if real else "false_positives"][kind] += count
                if count:
                    result["examples"].append(f"{'real' if real else 'FALSE POSITIVE'} {kind}: {path}: "
                                              f"{line.strip()[:150]}")
    return result


def report(name: str, result: dict) -> None:
    wrong = sum(result["false_positives"].values())
    print(f"{name}: {result['files']} files, {result['lines']} lines, {result['bytes'] / 1e6:.1f} MB: "
          f"{wrong} false positives ({wrong / max(result['lines'], 1) * 1000:.3f} per 1000 lines), by kind "
          f"{dict(sorted((k, v) for k, v in result['false_positives'].items() if v))}; "
          f"real addresses replaced: {dict(sorted((k, v) for k, v in result['real'].items() if v))}")


def main(argv=None):
    arguments = parse_args(argv)
    started = time.perf_counter()
    recall, misses = defaultdict(lambda: [0, 0]), []
    for kind, text, secrets in planted_set(arguments.seed, arguments.per_kind):
        output = Deidentifier().text(text)
        hit = caught(output, text, secrets)
        recall[kind][0] += hit
        recall[kind][1] += 1
        if not hit:
            misses.append((kind, text, output))

    false_positives, negatives_by_category = [], Counter()
    for category, text in synthetic_negatives(arguments.seed):
        negatives_by_category[category] += 1
        deidentifier = Deidentifier()
        if deidentifier.text(text) != text:
            false_positives.append((category, text, {k: v for k, v in deidentifier.counts.items() if v}))

    corpora = {f"standard library ({sys.version.split()[0]})": scan(stdlib_files(arguments.stdlib_files))}
    for directory in arguments.corpus:
        corpora[directory] = scan(corpus_files(directory))

    planted = sum(total for _, total in recall.values())
    found = sum(hit for hit, _ in recall.values())
    print(f"planted: {found}/{planted} caught ({found / planted:.1%}), {len(KINDS)} kinds x "
          f"{arguments.per_kind}, seed {arguments.seed}")
    for kind in KINDS:
        hit, total = recall[kind]
        print(f"  {kind:28s} {hit:3d}/{total:<3d} {hit / total:6.1%}")
    synthetic = sum(negatives_by_category.values())
    altered = len(false_positives)
    print(f"synthetic negatives: {altered}/{synthetic} altered ({altered / synthetic:.1%})")
    by_category = Counter(category for category, _, _ in false_positives)
    for category, total in negatives_by_category.items():
        print(f"  {category:28s} {by_category[category]:3d}/{total}")
    for name, result in corpora.items():
        report(name, result)
    print(f"time: {time.perf_counter() - started:.1f} s")
    if arguments.show:
        for kind, text, output in misses:
            print(f"MISS {kind}: {text!r} -> {output!r}")
        for category, text, counts in false_positives:
            print(f"FALSE POSITIVE {category}: {text!r} {counts}")
        for result in corpora.values():
            for example in result["examples"]:
                print(f"CORPUS {example}")
    figures = {"recall": {k: recall[k] for k in KINDS}, "synthetic_false_positives": len(false_positives),
               "synthetic_negatives": synthetic,
               "corpora": {name: {k: (dict(v) if isinstance(v, Counter) else v) for k, v in result.items()
                                  if k != "examples"} for name, result in corpora.items()}}
    if arguments.json:
        Path(arguments.json).write_text(json.dumps(figures, indent=2) + "\n")
    return figures


if __name__ == "__main__":
    main()
