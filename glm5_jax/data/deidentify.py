"""Best-effort de-identification of text: secrets, contact details and financial numbers are replaced
by placeholders, and each replacement is counted by kind.

    deidentifier = Deidentifier()
    deidentifier.text("mail bob@example.com")           # -> "mail <EMAIL>"
    deidentifier.text("password: hunter2")              # -> "password: <SECRET>"
    deidentifier.value({"role": "user", "content": ...})  # every string in a JSON value
    deidentifier.counts                                  # {"email": 1, ...}

Kinds, in the order they are applied (an earlier kind's placeholder is never matched by a later one):

    private_key        a PEM block, -----BEGIN ... PRIVATE KEY----- to its END line (or to the end of
                       its base64 when the END line is missing)                      -> <PRIVATE_KEY>
    url_credentials    the user:password of scheme://user:password@host               -> <CREDENTIALS>
    email              name@domain.tld                                               -> <EMAIL>
    api_key            keys with a known shape: OpenAI/Anthropic sk-..., Stripe sk_live_/sk_test_/
                       rk_live_/pk_live_/whsec_, GitHub ghp_/gho_/github_pat_..., GitLab glpat-,
                       Hugging Face hf_, npm_, Slack xox?- and its webhooks, Google AIza..., AWS
                       AKIA/ASIA..., SendGrid SG.x.y, JWTs (eyJ...); the credential after "Bearer "
                       or in an Authorization header, whatever its length               -> <API_KEY>
    secret_assignment  the value of password=, password: , secret:, api_key=, token=, client_secret,
                       DB_PASSWORD=, "passwd": "...", --password x, pin: 4821, "my password is
                       hunter2" and the like (the key name is kept); not code (password=pw,
                       token = next(tokens)) or a tokenizer's vocabulary (bos_token="<s>") -> <SECRET>
    aws_secret_key     40 characters of [A-Za-z0-9+/] with upper, lower and digits     -> <API_KEY>
    iban               an IBAN of a registered country with its length and mod-97 checksum -> <IBAN>
    credit_card        13-19 digits, plain or grouped by spaces or dashes, of a card network's
                       prefix and length, passing the Luhn check                      -> <CREDIT_CARD>
    ssn                US social security numbers 123-45-6789 / 123 45 6789 (valid area, group
                       and serial), or 9 digits right after "SSN"                     -> <SSN>
    secret_token       32+ characters of [A-Za-z0-9+/_=-] that are hex (letters and digits; kept
                       when a hash word names it: sha256, commit, blob/, or in a URL's path) or look
                       random (the character class changes at >= 45% of positions, as in base64,
                       and it is not made of words: identifiers, model names); UUIDs are kept -> <TOKEN>
    ipv6, ipv4         checked by the ipaddress module (IPv6 with a digit and not a slice a[1::2];
                       dotted quads not written as a version: "v1.2.3.4", "version 10.0.0.1";
                       loopback 127.x, 0.0.0.0 and 255.x netmasks are kept)          -> <IP_ADDRESS>
    phone              +CC international numbers (8-15 digits), (555) 123-4567, 555-123-4567 /
                       555.123.4567 / 555 123 4567 (with an optional leading 1), bare North American
                       numbers 2025550143 / 12025550143 (valid area code and exchange, not an
                       operand: x = 3644798167), national numbers with a trunk 0: 020 7946 0958,
                       01 23 45 67 89, 0044 20 7946 0958                                 -> <PHONE>

This is regex work, measured by bench/deidentify_recall.py (docs/feedback.md has the figures): it
misses what it has no pattern for (names, street addresses, 7-digit local numbers, secrets shorter
than 32 characters without a known prefix or a key name, a password that is a plain word) and
replaces some harmless strings (long hex digests with no hash word before them, version strings
shaped like IPv4 addresses, 10-digit numbers shaped like North American phone numbers).
"""

from __future__ import annotations

import ipaddress
import re
from collections import Counter
from collections.abc import Callable
from typing import Any

PLACEHOLDERS = {"private_key": "<PRIVATE_KEY>", "url_credentials": "<CREDENTIALS>", "email": "<EMAIL>",
                "api_key": "<API_KEY>", "secret_assignment": "<SECRET>", "aws_secret_key": "<API_KEY>",
                "iban": "<IBAN>", "credit_card": "<CREDIT_CARD>", "ssn": "<SSN>", "secret_token": "<TOKEN>",
                "ipv6": "<IP_ADDRESS>", "ipv4": "<IP_ADDRESS>", "phone": "<PHONE>"}
KINDS = tuple(PLACEHOLDERS)
# Keys whose values are structure, not text: roles, content-part types, tool-call ids (which must
# keep matching the tool results that quote them).
STRUCTURAL_KEYS = frozenset({"role", "type", "id", "tool_call_id"})
MIN_TOKEN_LENGTH = 32
RANDOM_CLASS_CHANGES = 0.45  # random base64 ~0.65, CamelCase identifiers ~0.4, paths and words far less
WORDY_FRACTION = 0.6

# IBAN lengths by country (the SWIFT IBAN registry).
IBAN_LENGTHS = {
    "AD": 24, "AE": 23, "AL": 28, "AT": 20, "AZ": 28, "BA": 20, "BE": 16, "BG": 22, "BH": 22, "BI": 27,
    "BR": 29, "BY": 28, "CH": 21, "CR": 22, "CY": 28, "CZ": 24, "DE": 22, "DJ": 27, "DK": 18, "DO": 28,
    "EE": 20, "EG": 29, "ES": 24, "FI": 18, "FK": 18, "FO": 18, "FR": 27, "GB": 22, "GE": 22, "GI": 23,
    "GL": 18, "GR": 27, "GT": 28, "HN": 28, "HR": 21, "HU": 28, "IE": 22, "IL": 23, "IQ": 23, "IS": 26,
    "IT": 27, "JO": 30, "KW": 30, "KZ": 20, "LB": 28, "LC": 32, "LI": 21, "LT": 20, "LU": 20, "LV": 21,
    "LY": 25, "MC": 27, "MD": 24, "ME": 22, "MK": 19, "MN": 20, "MR": 27, "MT": 31, "MU": 30, "NI": 28,
    "NL": 18, "NO": 15, "OM": 23, "PK": 24, "PL": 28, "PS": 29, "PT": 25, "QA": 29, "RO": 24, "RS": 22,
    "RU": 33, "SA": 24, "SC": 31, "SD": 18, "SE": 24, "SI": 19, "SK": 24, "SM": 27, "SO": 23, "ST": 25,
    "SV": 28, "TL": 23, "TN": 24, "TR": 26, "UA": 29, "VA": 22, "VG": 24, "XK": 20, "YE": 30,
}
# Card networks: (lowest prefix, highest prefix, lengths). A number needs one of them and the Luhn check.
CARD_NETWORKS = (
    (4, 4, (13, 16, 19)),                     # Visa
    (51, 55, (16,)), (2221, 2720, (16,)),     # Mastercard
    (34, 34, (15,)), (37, 37, (15,)),         # American Express
    (6011, 6011, range(16, 20)), (644, 649, range(16, 20)), (65, 65, range(16, 20)),  # Discover
    (3528, 3589, range(16, 20)),              # JCB
    (300, 305, range(14, 20)), (36, 36, range(14, 20)), (38, 39, range(14, 20)),  # Diners Club
    (62, 62, range(16, 20)),                  # UnionPay
    (2200, 2204, range(16, 20)),              # Mir
    (5018, 5018, range(12, 20)), (5020, 5020, range(12, 20)), (5038, 5038, range(12, 20)),
    (5893, 5893, range(12, 20)), (6304, 6304, range(12, 20)), (6759, 6759, range(12, 20)),
    (6761, 6763, range(12, 20)),              # Maestro
)
# 10-digit numbers that are famous constants, not phones: 2**31 - 1, 2**31, 2**32 - 1, 2**32.
NOT_PHONES = frozenset({"2147483647", "2147483648", "4294967295", "4294967296"})

_SECRET_NAMES = (r"pass(?:word|wd|phrase|code)?|pwd|pin|cvv|cvc|secret|token|api[_-]?key|apikey"
                 r"|access[_-]?key|secret[_-]?key"
                 r"|private[_-]?key|auth[_-]?key|signing[_-]?key|encryption[_-]?key|master[_-]?key"
                 r"|client[_-]?secret|credentials?")
_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_QUOTED = r"\"(?:[^\"\\\n]|\\.)*\"|'(?:[^'\\\n]|\\.)*'"
_NEWLINE = r"(?:\r?\n|\\n)"  # a line break, or "\n" inside a string literal
_PEM_BODY = r"[A-Za-z0-9+/=\s:,.\\-]"
# Without an END line: the lines that follow while they are base64 or headers, then a short last line.
_PEM_LINES = (rf"(?:[ \t]*{_NEWLINE}[ \t]*(?:[A-Za-z0-9+/=]{{16,}}|[A-Za-z-]+: [^\n\\]*"
              rf"|[A-Za-z0-9+/]{{2,15}}={{0,2}}(?=[ \t]*(?:{_NEWLINE}|$|[,;)\]\"'`]|\.(?:\s|$)))))*")
_PEM_LABEL = r"[A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?"
_KEY_SHAPES = (
    r"\b(?:sk|pk|rk)-[A-Za-z0-9_-]{16,}", r"\b(?:sk|rk|pk)_(?:live|test)_[A-Za-z0-9]{8,}",  # OpenAI, Stripe
    r"\bwhsec_[A-Za-z0-9]{16,}", r"\b(?:ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{30,}",  # Stripe webhooks, GitHub
    r"\bgithub_pat_[A-Za-z0-9_]{20,}", r"\bglpat-[A-Za-z0-9_-]{20}",  # GitHub, GitLab
    r"\bhf_[A-Za-z0-9]{30,}", r"\bnpm_[A-Za-z0-9]{36}",  # Hugging Face, npm
    r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b", r"\bxox[abposr]-[A-Za-z0-9-]{10,}",  # AWS, Slack
    r"hooks\.slack\.com/services/[A-Za-z0-9/]+",
    r"\bAIza[0-9A-Za-z_-]{35}", r"\bSG\.[A-Za-z0-9_-]{16,}\.[A-Za-z0-9_-]{16,}",  # Google, SendGrid
    r"\beyJ[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]*)?",  # JWT
)
_CREDENTIAL = r"(?P<value>[A-Za-z0-9._~+/-]+=*)"
_BARE_VALUE = r"[^\s\"'`&,;)}\]]*[^\s\"'`&,;)}\].!?:]"  # up to a space or a delimiter; not a sentence's "."
_SECRET_NAME = re.compile(rf"(?i:{_SECRET_NAMES})$")
_SECRET_WORDS = frozenset({"pass", "passwd", "password", "pwd", "secret", "token", "key", "apikey",
                           "credential", "credentials"})
# The last word before "token" in the names of credentials (access_token, GITHUB_TOKEN, authToken).
_CREDENTIAL_WORDS = frozenset({
    "access", "auth", "refresh", "api", "bearer", "session", "github", "gh", "gitlab", "slack", "bot",
    "csrf", "xsrf", "id", "hf", "oauth", "oauth2", "personal", "private", "secret", "client", "app", "user",
    "service", "npm", "pypi", "jwt", "login", "security", "sas", "discord", "telegram", "registry", "deploy",
    "webhook", "x"})
_PLACEHOLDER_VALUE = re.compile(r"<[^<>]*>|\$\{?[A-Za-z_]\w*\}?|\*+|x+|X+|\.\.\.")  # <your-key>, $TOKEN, ****
_FORMAT_FIELD = re.compile(r"%(?:\(\w+\))?[-#0 +]*\d*(?:\.\d+)?[a-zA-Z]|\{[^{}]*\}")  # %s, %(name)r, {0}
_CODE_VALUE = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+|.*[(\[].*|-?\d{1,3}(?:\.\d+)?")  # 4+ digits: a PIN
_LITERALS = frozenset({"none", "null", "nil", "true", "false", "undefined", "str", "bytes", "int", "bool",
                       "float", "any", "object", "optional", "required", "empty", "yes", "no"})
# A word naming a hex string a digest, up to 16 characters before it: "commit ", "_git_hash: str = '".
_HASH_WORDS = re.compile(r"(?i)(?:sha\d*|md5|hash|digest|checksum|commits?|blake2?\w?|crc\d*|fingerprint|etag"
                         r"|rev(?:ision)?|object|tree|blob|parent|oid|integrity)[^\n]{0,16}$")
_HEX_TOKEN = re.compile(rf"[0-9a-fA-F]{{{MIN_TOKEN_LENGTH},}}")
_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
_VERSION_BEFORE = re.compile(r"(?i)(?:version\w*|release|build|python|==|>=|<=|~=|sections?|chapter|§)"
                             r"[ :=\"'-]*$")
# A bare 10-digit number is code or data, not a phone, as an operand (x = 3644798167, h * 3644798167),
# a call's argument (f.seek(5368709120)) or one of a list of numbers ([3992670689, 2438360420]).
_OPERAND_BEFORE = re.compile(r"(?:[=*+^/%]|[^\s<>][ \t]*[<>]=?|[\w\]]\(|\d[\d.]*,?)[ \t]*$")
_NUMBER_AFTER = re.compile(r"\.?,?[ \t]*[-+]?\d")
_PHONE_WORDS = re.compile(r"(?i)phone|tel\b|mobile|cell|fax|call|contact|number|whatsapp|sms|reach")


def _character_class(char: str) -> int:
    return 0 if char.islower() else 1 if char.isupper() else 2 if char.isdigit() else 3


def looks_random(token: str) -> bool:
    """Whether a long [A-Za-z0-9+/_=-] string is a secret rather than a word, identifier or path:
    hex with letters and digits, or a character class (lower, upper, digit, other) that changes at
    RANDOM_CLASS_CHANGES of its positions or more, without being made of words (wordy)."""
    body = token.rstrip("=")
    if re.fullmatch(r"[0-9a-fA-F]+", body):  # random hex is ~38% letters: not a number (3.1415...d0)
        letters = sum(c.isalpha() for c in body)
        return 0.1 * len(body) <= letters <= 0.9 * len(body)
    classes = [_character_class(c) for c in body]
    changes = sum(a != b for a, b in zip(classes, classes[1:], strict=False))
    return changes >= RANDOM_CLASS_CHANGES * (len(body) - 1) and not wordy(body)


def wordy(token: str) -> bool:
    """Whether `token` is made of words, as identifiers, paths and model names are and random strings
    (about 1 in 10,000) are not: WORDY_FRACTION or more of it in runs of 3+ lowercase letters (one
    capital before) with vowels (Apertus1p5VisionTokenizerModel), or 3+ short pieces between
    separators, half of them words (ROT_TWO/ROT_THREE, meta-llama/Llama-4-Scout-17B-16E)."""
    runs = [run for run in re.findall(r"[A-Z]?[a-z]{3,}", token)
            if sum(c in "aeiouAEIOU" for c in run) >= 0.2 * len(run)]
    if sum(len(run) for run in runs) >= WORDY_FRACTION * len(token):
        return True
    pieces = [piece for piece in re.split(r"[/_.+-]+", token) if piece]
    words = sum(bool(re.fullmatch(r"[A-Z]?[a-z]{2,}|[A-Z]{2,}", piece)) for piece in pieces)
    return len(pieces) >= 3 and all(len(piece) <= 10 for piece in pieces) and 2 * words >= len(pieces)


def luhn_valid(digits: str) -> bool:
    """The Luhn (mod 10) check of card numbers: doubling every second digit from the right."""
    total = 0
    for position, char in enumerate(reversed(digits)):
        digit = int(char) * (2 if position % 2 else 1)
        total += digit - 9 if digit > 9 else digit
    return total % 10 == 0


def card_number(digits: str) -> bool:
    """Whether a string of digits is a payment card number: a network's prefix and length, and Luhn."""
    for low, high, lengths in CARD_NETWORKS:
        width = len(str(low))
        if len(digits) in lengths and low <= int(digits[:width]) <= high:
            return luhn_valid(digits)
    return False


def iban_valid(iban: str) -> bool:
    """Whether `iban` (separators allowed) is an IBAN: its country's length, mod-97 check (ISO 13616)."""
    compact = re.sub(r"[ -]", "", iban).upper()
    if IBAN_LENGTHS.get(compact[:2]) != len(compact) or not compact[2:4].isdigit():
        return False
    rearranged = compact[4:] + compact[:4]
    return int("".join(str(int(char, 36)) for char in rearranged)) % 97 == 1


def _words(identifier: str) -> list[str]:
    """An identifier's words, lowercased: dbPassword -> [db, password], AWS_SECRET -> [aws, secret]."""
    return [word.lower() for word in re.findall(r"[A-Z]?[a-z0-9]+|[A-Z0-9]+(?![a-z])", identifier)]


def _secret_value(match: re.Match) -> bool:
    """Whether `key<separator>value` assigns a secret rather than code or a tokenizer's vocabulary:
    `token = next(tokens)`, `password=password`, `token: str`, `bos_token="<s>"`, `'token': 3291` stay."""
    key, separator, value = match.group("key"), match.group("separator"), match.group("value")
    name = _SECRET_NAME.search(key)
    word, before = name.group(0).lower(), key[:name.start()].lstrip("-")
    if before and before[-1] not in "_.-" and not (before[-1].isalnum() and name.group(0)[0].isupper()
                                                   and not before[-1].isupper()):
        return False  # "bypass", "compass": the secret word must start a word of the key
    prose = separator.strip() in ("is", "was")  # "my password is hunter2"
    if not separator.strip() and not key.startswith("--"):
        return False  # "token expires": only a command-line flag takes its value after a space
    if word == "pass" and not before and "=" not in separator:
        return False  # the Python statement, a dict's 'pass': ...; DB_PASS and userPass are keys
    if prose and not (any(not c.isalpha() for c in value) or value[1:] != value[1:].lower()):
        return False  # "the password is incorrect": a word, not a password
    if word == "token" and _words(before) and _words(before)[-1] not in _CREDENTIAL_WORDS:
        return False  # bos_token, image_token, next_token: vocabulary or code, not credentials
    quoted = value[:1] in "\"'"
    content = value[1:-1] if quoted else value
    if (not any(c.isalnum() for c in _FORMAT_FIELD.sub("", content)) or _PLACEHOLDER_VALUE.fullmatch(content)
            or content.lower() in _LITERALS or _words(content) == _words(key.lstrip("-"))):
        return False  # "", "(", "%s:%s", "{0}", "<your-key>", "$TOKEN", "****", None, apiKey = "apiKey"
    if re.fullmatch(r"[\d_.,]+", content):  # a number: a PIN after a password key, else a count or an id
        digits = sum(c.isdigit() for c in content)
        pin = digits >= 4 and word.startswith(("pass", "pwd", "pin"))
        return pin or (word in ("cvv", "cvc") and digits >= 3)
    if word == "token" and not before and not (len(content) >= 8 and not re.search(r"\s", content) and (
            any(c.isdigit() for c in content) or content.lower() != content and content.upper() != content)):
        return False  # a bare `token` is a credential only when it looks like one
    if quoted:
        return True
    if len(separator) > 4 or content[0] in "{[(<`":
        return False  # aligned columns (a grammar: token = 1*tchar), or code and markup
    if _CODE_VALUE.fullmatch(content):
        return False  # self.password, getpass(), 0
    if re.fullmatch(r"[A-Za-z_]\w*", content) and key.upper() != key:
        # After a lowercase key, a bare identifier may be code: a variable (password=pw), a type
        # (token: AuthToken), a constant (api_key=DEFAULT_KEY) or one named like a secret. One with a
        # digit, or random-looking case (BTewdSzQ), is a secret; so is anything after an UPPER_CASE
        # (environment) key.
        if _SECRET_WORDS & set(_words(content)):
            return False
        return any(c.isdigit() for c in content) or not re.fullmatch(r"[a-z_]+|(?:[A-Z][a-z]+)+|[A-Z][A-Z_]*",
                                                                      content)
    return True


def _credential(match: re.Match) -> bool:
    """The credential after "Bearer " or in an Authorization header."""
    value = match.group("value")
    if "scheme" in match.re.groupindex:
        if match.group("scheme"):
            return True  # Authorization: Bearer x / Basic x / token x, whatever x is
        if _CODE_VALUE.fullmatch(value):
            return False  # authorization = request.headers.get(...)
    return not re.fullmatch(r"[A-Za-z][a-z]*s?", value)  # "Bearer token", "bearer authentication": prose


def _url_credentials(match: re.Match) -> bool:
    return match.group("value").split(":", 1)[1].lower() not in ("pass", "password", "secret", "pwd")


def _aws_secret_key(match: re.Match) -> bool:
    found = match.group(0)
    return (any(c.isupper() for c in found) and any(c.islower() for c in found)
            and any(c.isdigit() for c in found) and found.count("/") <= 4 and not wordy(found))


def _ssn(match: re.Match) -> bool:
    digits = re.sub(r"\D", "", match.group("value") if "value" in match.re.groupindex else match.group(0))
    area, group, serial = digits[:3], digits[3:5], digits[5:]
    return area not in ("000", "666") and area[0] != "9" and group != "00" and serial != "0000"


def _secret_token(match: re.Match) -> bool:
    found = match.group(0)
    if _UUID.fullmatch(found) or re.match(r"(?i)sha(?:256|384|512)-", found):
        return False  # a UUID, a subresource-integrity digest
    in_url_path = re.search(r"https?://[^\s?#]*$", match.string[:match.start()])
    for segment in re.finditer(r"[^/-]+", found):  # a path's hex segment (.../blob/<sha>/...) alone
        if _HEX_TOKEN.fullmatch(segment.group(0)):
            named = _HASH_WORDS.search(match.string[:match.start() + segment.start()][-40:])  # sha256: ...
            return looks_random(segment.group(0)) and not named and not in_url_path  # gist, page ids
    if in_url_path:  # a URL's path: a secret is one long random piece (a webhook's token), not the path
        return any(len(piece) >= MIN_TOKEN_LENGTH and looks_random(piece) for piece in found.split("/"))
    return looks_random(found)


def _ipv6(match: re.Match) -> bool:
    found = match.group(0)
    try:
        ipaddress.IPv6Address(found)
    except ValueError:
        return False
    groups = [group for group in found.split(":") if group]
    # "Abc::Def" is C++, a[1::2] a slice and "issues/3974::" reST more often than an address (and ::1
    # identifies no one)
    return any(c.isdigit() for c in found) and len(groups) >= 2 and (
        len(groups) >= 3 or any(len(group) >= 3 for group in groups))


def _ipv4(match: re.Match) -> bool:
    found = match.group(0)
    if found.startswith(("127.", "255.")) or found == "0.0.0.0":
        return False  # loopback, unspecified, netmasks and broadcast: nobody's address
    return not _VERSION_BEFORE.search(match.string[:match.start()][-20:])  # v1.2.3.4, version 10.0.0.1


def _phone(match: re.Match) -> bool:
    found = match.group(0)
    digits = re.sub(r"\D", "", found)
    if found.isdigit():  # bare North American: no N11 area code or exchange, no famous constant
        local = digits[1:] if len(digits) == 11 else digits
        before = match.string[max(0, match.start() - 30):match.start()]
        after = match.string[match.end():match.end() + 4]
        if (_OPERAND_BEFORE.search(before) or _NUMBER_AFTER.match(after)) and not _PHONE_WORDS.search(before):
            return False
        return local not in NOT_PHONES and local[1:3] != "11" and local[4:6] != "11"
    if found.startswith("00"):  # international with 00 instead of +
        return 10 <= len(digits) <= 16
    if found.startswith("0"):  # national, with a trunk 0
        return 10 <= len(digits) <= 11
    if found.startswith("+0") or re.fullmatch(r"\+\d+\.\d+|\+\d{4}-\d\d-\d\d.*", found):
        return False  # no country code starts with 0; +35236450.6 is a signed number, +1980-02-29 a date
    return 8 <= len(digits) <= 15


def _iban(match: re.Match) -> bool:
    return iban_valid(match.group(0))


def _credit_card(match: re.Match) -> bool:
    return card_number(re.sub(r"[ -]", "", match.group(0)))


# (kind, regex, the check a regex cannot make or None), in the order applied. Where the regex has a
# `value` group, only that group is replaced (the rest is context: the key name, "Bearer ").
_RULES: tuple[tuple[str, re.Pattern, Callable[[re.Match], bool] | None], ...] = tuple(
    (kind, re.compile(pattern), check) for kind, pattern, check in (
        ("private_key", rf"-----BEGIN {_PEM_LABEL}-----(?:{_PEM_BODY}{{0,16384}}?-----END {_PEM_LABEL}-----"
                        rf"|{_PEM_LINES})", None),
        ("url_credentials", r"(?<=://)(?P<value>[^\s/@:]*:[^\s/@]+)(?=@[A-Za-z0-9\[])", _url_credentials),
        # Not git@github.com:owner/repo (scp-style) or ssh://git@host/ (a URL's user name).
        ("email", r"(?<![\w.+%-])(?<!://)[A-Za-z0-9._%+-]+@(?:[A-Za-z0-9-]+\.)+[A-Za-z]{2,}\b(?!:[\w.~-]*/)",
         None),
        ("api_key", "|".join(_KEY_SHAPES), None),
        ("api_key", r"(?i:\bauthorization)[\"']?[ \t]*[:=][ \t]*[\"']?"
                    rf"(?P<scheme>(?i:bearer|basic|token|digest)[ \t]+)?{_CREDENTIAL}", _credential),
        ("api_key", rf"(?i:\bbearer)[ \t]+{_CREDENTIAL}", _credential),
        ("secret_assignment", rf"(?<![\w.-])(?P<key>(?:--)?[\w.-]*?(?i:{_SECRET_NAMES}))(?![\w-])[\"']?"
                              r"(?P<separator>[ \t]*(?:=>|:=|=(?!=)|:)[ \t]*|[ \t]+(?:is|was)[ \t]+"
                              r"|[ \t]+)"
                              rf"(?P<value>{_QUOTED}|{_BARE_VALUE})", _secret_value),
        ("aws_secret_key", r"(?<![A-Za-z0-9+/=_-])[A-Za-z0-9+/]{40}(?![A-Za-z0-9+/=_-])", _aws_secret_key),
        ("iban", r"(?<![\w-])[A-Za-z]{2}\d{2}(?:[ -]?[A-Za-z0-9]{4}){2,7}(?:[ -]?[A-Za-z0-9]{1,3})?(?![\w-])",
         _iban),
        ("credit_card", r"(?<![\w.-])(?:\d{4}([ -])\d{4}\1\d{4}\1\d{4}(?:\1\d{3})?|\d{4}([ -])\d{6}\2\d{4,5}"
                        r"|\d{12,19})(?![\w-]|\.\d)", _credit_card),
        ("ssn", r"(?<![\w.-])\d{3}([ -])\d{2}\1\d{4}(?![\w-]|\.\d)", _ssn),
        ("ssn", r"(?i:\bssn|\bsocial security(?: number| no\.?)?)\W{0,4}(?P<value>\d{9})\b", _ssn),
        ("secret_token", rf"(?<![A-Za-z0-9+/_-])[A-Za-z0-9+/_-]{{{MIN_TOKEN_LENGTH},}}={{0,2}}"
                         r"(?![A-Za-z0-9+/_=-])", _secret_token),
        ("ipv6", r"(?<![\w:])(?:[0-9A-Fa-f]{1,4}|:)(?::[0-9A-Fa-f]{0,4}){2,7}(?![\w:])", _ipv6),
        ("ipv4", rf"(?<![\w.]){_OCTET}(?:\.{_OCTET}){{3}}(?!\d|\.\d)", _ipv4),
        ("phone", "|".join((
            r"(?<![\w+])\+\d[\d ().-]{6,}\d(?!\w)",  # +CC ...
            r"(?<![\w(])\(\d{2,4}\)[ .-]?\d{3,4}[ .-]?\d{3,4}(?!\w)",  # (555) 123-4567
            r"(?<![\w.-])(?:1([ .-]))?\d{3}([ .-])\d{3}\2\d{4}(?!\w|[.-]\d)",  # 1-555-123-4567
            r"(?<![\w.+/-])1?[2-9]\d\d[2-9]\d{6}(?!\w|\.[\d,)\]])",  # bare North American
            # national, with a trunk 0 (not the tail of a grouped IBAN or of a list of numbers)
            r"(?<![\w.+-])(?<![0-9A-Z]{4} )(?<!\d[ -])0\d{1,4}(?:[ -]\d{2,8}){1,4}(?!\w|[.-]\d|[ -]\d)",
        )), _phone),
    ))


class Deidentifier:
    """Replaces what KINDS describe with placeholders; `counts` adds up the replacements by kind."""

    def __init__(self):
        self.counts: Counter[str] = Counter({kind: 0 for kind in KINDS})

    def text(self, text: str) -> str:
        for kind, pattern, check in _RULES:
            def replace(match: re.Match, kind=kind, check=check) -> str:
                if check is not None and not check(match):
                    return match.group(0)
                self.counts[kind] += 1
                if "value" not in match.re.groupindex:
                    return PLACEHOLDERS[kind]
                start, end = match.span("value")
                placeholder = PLACEHOLDERS[kind]
                value = match.group("value")
                if kind == "secret_assignment" and value[:1] in "\"'":
                    placeholder = value[0] + placeholder + value[0]  # "password": "<SECRET>"
                whole = match.group(0)
                return whole[:start - match.start()] + placeholder + whole[end - match.start():]

            text = pattern.sub(replace, text)
        return text

    def value(self, value: Any) -> Any:
        """A JSON value with every string de-identified, except under STRUCTURAL_KEYS (and keys)."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, list):
            return [self.value(item) for item in value]
        if isinstance(value, dict):
            return {key: item if key in STRUCTURAL_KEYS else self.value(item) for key, item in value.items()}
        return value
