"""What no configuration message, log line or printed configuration shows: the value of a key named as a
credential, and the password in a URL's user info."""

from __future__ import annotations

import re

# A key is a credential when the last word of its name (words split at `_`, `-`, `.`) is one of these, or its name
# ends with one of `_CREDENTIAL_ENDINGS`: `auth_token`, `api_key`, `MMGATE_ENGINE__AUTH_TOKEN`, `redis_password`.
_CREDENTIAL_WORDS = frozenset(
    {"token", "key", "secret", "password", "passwd", "pass", "pwd", "auth", "apikey", "credential", "credentials"}
)
_CREDENTIAL_ENDINGS = ("token", "secret", "password")
_WORD_BREAK = re.compile(r"[_.\-]+")
_URL_PASSWORD = re.compile(r"(://[^/@:]*:)[^/@]*@")

HIDDEN = "<hidden>"


def is_credential(name: str) -> bool:
    """Whether the key or environment variable `name` holds a credential, going by its name."""
    words = [word for word in _WORD_BREAK.split(name.lower()) if word]
    return bool(words) and (words[-1] in _CREDENTIAL_WORDS or words[-1].endswith(_CREDENTIAL_ENDINGS))


def hide_url_password(text: str) -> str:
    """`text` with the password of every URL's user info replaced: `redis://:<hidden>@host:6379/0`."""
    return _URL_PASSWORD.sub(rf"\1{HIDDEN}@", text)
