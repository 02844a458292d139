"""The secret-redaction rules (docs/REFERENCE.md: never print or store a secret), the one policy both sides share:
the controller (nodectl/secrets.py) imports this module; on a node, launchers/probe.py runs with it, as one script on
stdin (nodectl/remote/probe_nodes.py: probe_source puts this text in place of probe.py's import line). Standard
library only, Python 3.8+ syntax: it runs under whatever Python a node has.
"""
from __future__ import annotations

import re

SECRET_MARKERS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "PASSPHRASE", "CREDENTIAL", "PRIVATE_KEY", "API_KEY",
                  "ACCESS_KEY", "CONNECTION_STRING", "APIKEY")
SECRET_WORDS = {"AUTH", "PAT", "DSN", "COOKIE", "SESSION"}   # whole words of a NAME_LIKE_THIS
# Words of a name that begin like these mark a secret too: DB_PASS, MYSQL_PWD, SMTP_PASSWORD, WANDB_KEY2, --db-pass
SECRET_WORD = re.compile(r"^(?:PASS|PWD|SECRET|TOKEN|CREDENTIAL)|^KEYS?\d*$")
SECRET_PREFIXES = ("AWS_",)
# A scheme only where a word starts (the lookbehind): each character is then read a bounded number of times, so
# redaction stays linear on any input (a 200 KB value used to take minutes).
URL_CREDENTIALS = re.compile(r"(?<![A-Za-z0-9+.\-])(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]{0,31}://)(?P<userinfo>[^/@\s]+)@")
# Values that are secrets whatever the variable is called: provider token formats, AWS key ids, JWTs, PEM keys.
SECRET_VALUES = re.compile(
    r"(gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}|glpat-[A-Za-z0-9_\-]{20,}|hf_[A-Za-z0-9]{20,}"
    r"|sk-[A-Za-z0-9_\-]{20,}|xox[abposr]-[A-Za-z0-9\-]{10,}|(?:AKIA|ASIA)[A-Z0-9]{16}|AIza[0-9A-Za-z_\-]{35}"
    r"|eyJ[A-Za-z0-9_\-]{8,}\.eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}|-----BEGIN [A-Z ]*PRIVATE KEY-----)")
# key=value secrets inside connection strings and query strings: the value is masked, the rest kept.
SECRET_PAIRS = re.compile(r"(?i)\b(AccountKey|SharedAccessKey|SharedAccessSignature|password|pwd|passwd|secret|"
                          r"token|sig|api[_-]?key|access[_-]?token|signature|credential|security[_-]?token|"
                          r"AWSAccessKeyId)=([^;&#\s]+)")
# A URL's query or fragment parameter whose name says it carries a credential: presigned S3 and GCS URLs
# (X-Amz-Signature, X-Amz-Credential, X-Amz-Security-Token, AWSAccessKeyId + Signature, X-Goog-Signature), Azure SAS
# (sig), bearer tokens (token, access_token, auth), keys and passwords.
URL_SECRET_PARAM = re.compile(r"(?i)(?:^|[-_.])(?:signature|sig|credential|security[-_]?token|token|auth\w*|"
                              r"password|passwd|pwd|secret|key|apikey|awsaccesskeyid|session)$")
REDACTED = "***"


def is_secret_name(name: str) -> bool:
    upper = name.upper()
    words = [w for w in re.split(r"[^A-Z0-9]+", upper) if w]
    return (any(marker in upper for marker in SECRET_MARKERS) or upper.endswith("_KEY")
            or upper.startswith(SECRET_PREFIXES) or bool(SECRET_WORDS & set(words))
            or any(SECRET_WORD.match(w) for w in words))


def redact_text(text: str) -> str:
    """Any text as it may be shown or stored: a token-shaped value anywhere makes the whole text '***';
    passwords and keys inside connection strings and URLs are masked."""
    if SECRET_VALUES.search(text):
        return REDACTED
    if "://" in text:
        text = URL_CREDENTIALS.sub(lambda m: m["scheme"] + REDACTED + "@", text)
    return SECRET_PAIRS.sub(lambda m: f"{m[1]}={REDACTED}", text)


def redact_words(text: str) -> str:
    """Prose as it may be shown or stored (a stack's source line, a verdict, a log line): each token-shaped value
    masked where it stands, the rest kept, so the line still says where the program is."""
    text = SECRET_VALUES.sub(REDACTED, text)
    if "://" in text:
        text = URL_CREDENTIALS.sub(lambda m: m["scheme"] + REDACTED + "@", text)
    return SECRET_PAIRS.sub(lambda m: f"{m[1]}={REDACTED}", text)


def url_secret(url: str):
    """What in `url` is a credential, in words, or None: user:password@, a query or fragment parameter named like
    a signature, token or key (a presigned URL's X-Amz-Signature, ?token=, #sig=), or a token-shaped value anywhere.
    The one rule for every URL nodectl takes (the inventory's and the flags'): such a URL is refused, never stored."""
    from urllib.parse import parse_qsl, urlsplit

    if SECRET_VALUES.search(url):
        return "a token-shaped value"
    try:
        parts = urlsplit(url)
    except ValueError:
        return None
    if "@" in parts.netloc:
        return "credentials (user:password@)"
    for where, text in (("query", parts.query), ("fragment", parts.fragment)):
        for name, _ in parse_qsl(text, keep_blank_values=True):
            if URL_SECRET_PARAM.search(name.strip()):
                return f"a credential in its {where} ({name.strip()[:40]}=)"
    return None


def mask_url(url: str) -> str:
    """`url` as it may be echoed in an error: user:password@ and every query and fragment value masked (any of them
    may be a signature), token-shaped values masked."""
    text = SECRET_VALUES.sub(REDACTED, url)
    text = URL_CREDENTIALS.sub(lambda m: m["scheme"] + REDACTED + "@", text)
    head, mark, rest = text.partition("?") if "?" in text else text.partition("#")
    if not mark:
        return text
    return head + mark + re.sub(r"=([^&#;]*)", "=" + REDACTED, rest)


def redact_value(name: str, value: str) -> str:
    """The value as it may be shown: '***' for a secret-named variable, else by the value's shape."""
    if is_secret_name(name):
        return REDACTED
    return redact_text(value)


def redact_env(env: dict) -> dict:
    return {name: redact_value(name, str(value)) for name, value in env.items()}


def _secret_option(word: str) -> bool:
    return word.startswith("-") and is_secret_name(word.lstrip("-").replace("-", "_"))


def _short_password(arg: str, following) -> bool:
    """`-p X` / `-pX`: a password to mysql, mysqldump, sshpass and their kind, a port or a count to others. Taken
    as a password unless X is a number (the value shown; a port shown as *** would cost nothing, but a script's
    command line recorded with *** cannot be replayed by --resume)."""
    if arg == "-p":
        return following is not None and not following.isdigit()
    return arg.startswith("-p") and len(arg) > 2 and not arg[2:].isdigit() and not arg.startswith("-p=")


def redact_args(args) -> list:
    """A command line as it may be shown or stored: the value of a secret-named option (`--hf-token X`,
    `--api-key=X`), of `-p` unless a number (`-p X`, `-pX`), and any token-shaped argument become '***'."""
    args = list(args)
    out, hide_next = [], False
    for i, arg in enumerate(args):
        following = args[i + 1] if i + 1 < len(args) else None
        if hide_next:
            out.append(REDACTED)
            hide_next = False
        elif ENV_OPTION.match(arg):   # --env=X=.., -eX=..: the name decides, as for `-e X=..`
            name = ENV_OPTION.match(arg)
            out.append(name[0] + REDACTED if is_secret_name(name["name"]) else redact_text(arg))
        elif arg.startswith("-") and "=" in arg and _secret_option(arg.split("=", 1)[0]):
            out.append(arg.split("=", 1)[0] + "=" + REDACTED)
        elif _secret_option(arg) or arg == "-p" and _short_password(arg, following):
            out.append(arg)
            hide_next = True
        elif _short_password(arg, following):
            out.append("-p" + REDACTED)
        elif ASSIGNMENT.match(arg) and is_secret_name(arg.split("=", 1)[0]):   # `-e WANDB_API_KEY=...`, `env X=..`
            out.append(arg.split("=", 1)[0] + "=" + REDACTED)
        else:
            out.append(redact_text(arg))
    return out


ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
# an environment setting joined to its option: --env=NAME=value (docker, podman, enroot), -eNAME=value,
# --setenv=NAME=value, --env-NAME=value is not one
ENV_OPTION = re.compile(r"^(?:--env=|--setenv=|--set-env=|-e)(?P<name>[A-Za-z_][A-Za-z0-9_]*)=")


def redact_tree(value):
    """Every string in a JSON-shaped value through redact_words (a saved diagnosis, say)."""
    if isinstance(value, str):
        return redact_words(value)
    if isinstance(value, list):
        return [redact_tree(v) for v in value]
    if isinstance(value, dict):
        return {k: redact_tree(v) for k, v in value.items()}
    return value
