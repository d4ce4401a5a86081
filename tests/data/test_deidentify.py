"""De-identification of the feedback export (glm5_jax/data/deidentify.py): every kind replaced and
counted, the key name or header kept around a replaced value, checksum-invalid lookalikes and
ordinary code and prose left alone. Pure Python (no JAX); bench/deidentify_recall.py measures
recall and false positives at scale."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from glm5_jax.data.deidentify import KINDS, Deidentifier, card_number, iban_valid, luhn_valid

PEM = ("-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA3Tz2mr7SZiAMfQyuvBjM9Oi0EnGP7Rqx1sVYkN0Jc8bpLw\n"
       "q9ZKx4Wv7Tt3nR2Hy6mPc+QxL0dG/ABCD==\n-----END RSA PRIVATE KEY-----")
# The 16 kinds planted when issue 37 was filed (the scrubber then caught the first 6): text -> output.
ISSUE_KINDS = {
    "email": ("write to jane.doe+work@mail.example.co.uk today", "write to <EMAIL> today"),
    "formatted phone": ("call +1 (555) 123-4567 or 555-123-4567", "call <PHONE> or <PHONE>"),
    "ipv4": ("ping 192.168.10.42.", "ping <IP_ADDRESS>."),
    "ipv6": ("ssh to 2001:db8:85a3::8a2e:370:7334 now", "ssh to <IP_ADDRESS> now"),
    "openai key": ("use sk-proj-4f9Tq2LmZx8Rk1VbN7 for it", "use <API_KEY> for it"),
    "jwt": ("t=eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
            "t=<API_KEY>"),
    "spaced card": ("card 4111 1111 1111 1111 exp 12/27", "card <CREDIT_CARD> exp 12/27"),
    "dashed card": ("my card is 5500-0000-0000-0004.", "my card is <CREDIT_CARD>."),
    "ssn": ("SSN 123-45-6789, born 1970", "SSN <SSN>, born 1970"),
    "iban": ("pay to DE89 3704 0044 0532 0130 00 please", "pay to <IBAN> please"),
    "password assignment": ("login with password: hunter2 then", "login with password: <SECRET> then"),
    "pem private key": (f"my key:\n{PEM}\nthanks", "my key:\n<PRIVATE_KEY>\nthanks"),
    "aws secret key": ("aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
                       "aws_secret_access_key = <SECRET>"),
    "short bearer token": ("curl -H 'Authorization: Bearer abc123' ...",
                           "curl -H 'Authorization: Bearer <API_KEY>' ..."),
    "stripe key": ("STRIPE sk_live_4eC39HqLyjWDarjtT1zdp7dc here", "STRIPE <API_KEY> here"),
    "bare 10-digit phone": ("call me at 2025550143 tonight", "call me at <PHONE> tonight"),
}
MORE = [  # (text, output): the other shapes of each kind
    ("4111111111111111 and 378282246310005", "<CREDIT_CARD> and <CREDIT_CARD>"),
    ("Amex 3782 822463 10005; Diners 3056-930902-5904", "Amex <CREDIT_CARD>; Diners <CREDIT_CARD>"),
    ("SSN: 078051120; ssn 219 09 9999", "SSN: <SSN>; ssn <SSN>"),
    ("GB82WEST12345698765432 or gb82 west 1234 5698 7654 32", "<IBAN> or <IBAN>"),
    ('{"password": "correct horse", "user": "bob"}', '{"password": "<SECRET>", "user": "bob"}'),
    ("DB_PASSWORD=supersecret\nDB_USER=app", "DB_PASSWORD=<SECRET>\nDB_USER=app"),
    ("secret: s3cr3t-v4lue, api_key=Zx81kQpL2m&x=1", "secret: <SECRET>, api_key=<SECRET>&x=1"),
    ("token=abc123def456 passwd='Tr0ub4dor&3'", "token=<SECRET> passwd='<SECRET>'"),
    ("client_secret: 'Qm9vYmFyMTI' --password hunter2", "client_secret: '<SECRET>' --password <SECRET>"),
    ("x-api-key: BTewdSzQ; GITHUB_TOKEN=abcdefgh", "x-api-key: <SECRET>; GITHUB_TOKEN=<SECRET>"),
    ("PIN: 4821, password=123456, cvv 123", "PIN: <SECRET>, password=<SECRET>, cvv 123"),  # cvv: no ":"
    ("my password is hunter2. The password is wrong.", "my password is <SECRET>. The password is wrong."),
    ("secret key wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY.", "secret key <API_KEY>."),
    ("AKIAIOSFODNN7EXAMPLE / ASIAY34FZKBOKMUTVV7A", "<API_KEY> / <API_KEY>"),
    ("ghp_" + "a1B2" * 9 + " github_pat_11ABCDEFG0123456789_" + "abcdefghijklmnopqrstuvwxyz0123456789" * 2,
     "<API_KEY> <API_KEY>"),
    ("xoxb-123456789012-1234567890123-AbCdEfGhIjKlMnOpQrStUvWx", "<API_KEY>"),
    ("AIzaSyA-1234567890abcdefghijklmnopqrstu sk-ant-api03-abcdefghijklmnopqrstuvwx", "<API_KEY> <API_KEY>"),
    ("rk_live_51Habcdefgh sk_test_4eC39HqLyjWDarjt", "<API_KEY> <API_KEY>"),
    ("use bearer x9 or Bearer 0123456789abcdefghijklmnopqrstuvwxyz0123456789ABCDEF",
     "use bearer <API_KEY> or Bearer <API_KEY>"),
    ("Authorization: Basic dXNlcjpwYXNz", "Authorization: Basic <API_KEY>"),
    ("postgres://admin:s3cret@db.example.com:5432/app", "postgres://<CREDENTIALS>@db.example.com:5432/app"),
    ("+44 20 7946 0958, 020 7946 0958, 01 23 45 67 89", "<PHONE>, <PHONE>, <PHONE>"),
    ("1-800-555-0199 or 555.123.4567 or 12025550143", "<PHONE> or <PHONE> or <PHONE>"),
    ("session 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08 ok", "session <TOKEN> ok"),
    ("-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQ\nAAAAAA==\n\nrest",
     "<PRIVATE_KEY>\n\nrest"),  # cut off before its END line
    ('KEY = "-----BEGIN PRIVATE KEY-----\\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC\\n-----END PRIVATE KEY-----\\n"',
     'KEY = "<PRIVATE_KEY>\\n"'),  # inside a string literal
]
UNCHANGED = [
    "4111 1111 1111 1112 and 5500-0000-0000-0005 and 4111111111111112",  # Luhn fails
    "DE89 3704 0044 0532 0130 01 and GB82WEST12345698765433",  # mod-97 fails
    "000-12-3456 666-12-3456 900-12-3456 123-00-4567 123-45-0000",  # no such SSN
    "id 550e8400-e29b-41d4-a716-446655440000 and urn:uuid:6FA459EA-EE8A-3CA4-894E-DB77E160355E",
    "commit 4b825dc642cb6eb9a060e54bf8d69288fbee4904, sha256: " + "e3b0c44298fc1c149afbf4c8996fb924" * 2,
    "https://github.com/tcltk/tk/blob/064ff9941b4b80b85916a8afe86a6c21fd388b54/library/text.tcl#L670",
    "Python 3.11.7, numpy==1.26.4, version 10.0.19045.2965, v1.2.3.4, build 10.0.22621.1",
    "2024-01-15T10:30:00Z, 15/01/2024, 1705312200, 1705312200123, 12:30:45",
    "ISBN 978-0-306-40615-7, 9780306406157, ISBN 0-306-40615-2, 0306406152",
    'File "/usr/lib/python3.11/json/decoder.py", line 337, in decode; src/a.py:8123:17',
    "x = 2147483647; h ^= hx * 3644798167; 1,234,567; 3.14159265358979; 0x7fffffff",
    "127.0.0.1, 0.0.0.0, 255.255.255.0, ::1, a[1::2], std::vector<int>",
    "password = getpass.getpass(); def login(user, password): token = tokens.pop(0)",
    "api_key = os.environ['API_KEY']; secret = secrets.token_hex(16); password=password, token: str = None",
    "bos_token = '<s>'; image_token=\"[IMG]\"; max_tokens: 256; {'score': 0.04, 'token': 3291}",
    "headers = {'Authorization': f'Bearer {token}'}; Authorization: Bearer $TOKEN; api_key: <your-api-key>",
    "The bearer token is sent in the header. Password must be at least 8 characters. Tokens expire.",
    'raise SyntaxError("Invalid token: %r" % value); # token          = 1*tchar',
    "git@github.com:owner/repo.git, ssh://git@github.com/owner/repo, https://user:pass@host/path",
    "meta-llama/Llama-4-Scout-17B-16E, Apertus1p5VisionTokenizerVectorQuantizer",
    "ROT_TWO/ROT_THREE/ROT_FOUR/ROT_N, JUMP_IF_TRUE_OR_POP/JUMP_IF_FALSE_OR_POP",
    "MyVeryLongClassNameForHTTP2Connections, /usr/lib/python3/dist-packages/SomeModule2Name",
]
# Real files of the standard library about passwords, tokens, cookies and numbers: nothing in them is
# personal data or a secret, and nothing may change.
STDLIB_FILES = ("getpass.py", "netrc.py", "base64.py", "shlex.py", "json/decoder.py", "http/cookiejar.py")


@pytest.mark.parametrize("kind", ISSUE_KINDS)
def test_each_kind_from_the_issue_is_replaced(kind):
    text, expected = ISSUE_KINDS[kind]
    assert Deidentifier().text(text) == expected


@pytest.mark.parametrize("text, expected", MORE)
def test_other_shapes_of_each_kind_are_replaced(text, expected):
    assert Deidentifier().text(text) == expected


@pytest.mark.parametrize("text", UNCHANGED)
def test_lookalikes_and_ordinary_code_and_prose_are_left_alone(text):
    deidentifier = Deidentifier()
    assert deidentifier.text(text) == text
    assert sum(deidentifier.counts.values()) == 0


def test_real_standard_library_files_are_left_alone():
    root = Path(os.__file__).parent
    for name in STDLIB_FILES:
        source = (root / name).read_text(encoding="utf-8")
        assert Deidentifier().text(source) == source, name


def test_checksums():
    assert luhn_valid("79927398713") and not luhn_valid("79927398710")
    assert card_number("4111111111111111") and card_number("378282246310005")
    assert not card_number("4111111111111112")
    assert not card_number("1234567812345670")  # Luhn-valid, but no card network starts with 1
    assert iban_valid("GB82 WEST 1234 5698 7654 32") and iban_valid("NO9386011117947")
    assert not iban_valid("GB82 WEST 1234 5698 7654 33")  # checksum
    assert not iban_valid("GB82WEST123456987654")  # length
    assert not iban_valid("XX82WEST12345698765432")  # no such country


def test_replacements_are_counted_by_kind_and_structure_is_kept():
    deidentifier = Deidentifier()
    for text, _ in ISSUE_KINDS.values():
        deidentifier.text(text)
    counts = {kind: count for kind, count in deidentifier.counts.items() if count}
    assert counts == {"email": 1, "phone": 3, "ipv4": 1, "ipv6": 1, "api_key": 4, "credit_card": 2, "ssn": 1,
                      "iban": 1, "secret_assignment": 2, "private_key": 1}
    assert set(deidentifier.counts) == set(KINDS)
    message = {"role": "user", "content": [{"type": "text", "text": "me@x.org"}], "tool_call_id": "call_1"}
    assert deidentifier.value(message) == {"role": "user", "content": [{"type": "text", "text": "<EMAIL>"}],
                                           "tool_call_id": "call_1"}
