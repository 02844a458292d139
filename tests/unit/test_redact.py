import time

import pytest

from nodectl.secrets import redact_args, redact_env, redact_text, redact_value


def test_secret_names_are_redacted():
    env = {"HF_TOKEN": "hf_abc", "WANDB_API_KEY": "w", "AWS_ACCESS_KEY_ID": "AKIA", "AWS_SECRET_ACCESS_KEY": "s",
           "DB_PASSWORD": "p", "MY_PASSWD": "p", "GCP_CREDENTIALS": "c", "SSH_PRIVATE_KEY": "k", "SIGNING_KEY": "k",
           "GITHUB_TOKEN": "ghp", "client_secret": "x"}
    assert set(redact_env(env).values()) == {"***"}


def test_ordinary_values_kept_and_url_credentials_masked():
    assert redact_value("NCCL_SOCKET_IFNAME", "ens1") == "ens1"
    assert redact_value("KEYBOARD", "us") == "us"
    assert redact_value("HF_ENDPOINT", "https://user:hunter2@hf.example/x") == "https://***@hf.example/x"
    assert redact_value("PIP_INDEX_URL", "https://tok@pypi.example/simple") == "https://***@pypi.example/simple"
    assert redact_value("HTTP_PROXY", "http://proxy:3128") == "http://proxy:3128"


# Real formats (made-up values of the right shape). Each must be hidden whatever the variable is called.
TOKEN_SHAPES = {
    "GitHub classic PAT": "ghp_" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8",
    "GitHub fine-grained PAT": "github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJ",
    "GitHub app token": "ghs_" + "0123456789abcdefghijABCDEFGHIJ0123",
    "GitLab PAT": "glpat-" + "abcdefghij0123456789",
    "Hugging Face": "hf_" + "aBcDeFgHiJkLmNoPqRsTuVwXyZ012345",
    "OpenAI": "sk-proj-" + "Abc123Def456Ghi789Jkl012Mno345Pqr678",
    "Slack bot": "xoxb-" + "123456789012-1234567890123-AbCdEfGhIjKlMnOpQrStUvWx",
    "AWS access key id": "AKIA" + "IOSFODNN7EXAMPLE",
    "AWS session key id": "ASIA" + "Y34FZKBOKMUTVV7A",
    "Google API key": "AIza" + "SyA-1234567890abcdefghijklmnopqrstu",
    "JWT": "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
    "PEM private key": "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n-----END OPENSSH PRIVATE KEY-----",
}


def test_token_shaped_values_are_hidden_under_any_name():
    for label, value in TOKEN_SHAPES.items():
        assert redact_value("UNREMARKABLE_SETTING", value) == "***", label
        assert redact_value("ARG", f"--token={value}") == "***", label


def test_connection_strings_keep_their_shape_with_secrets_masked():
    azure = ("DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=c2VjcmV0a2V5c2VjcmV0a2V5==;"
             "EndpointSuffix=core.windows.net")
    assert redact_value("STORAGE", azure) == ("DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=***;"
                                              "EndpointSuffix=core.windows.net")
    assert redact_value("DB", "Server=db;Database=x;User Id=u;Password=hunter2;") == \
        "Server=db;Database=x;User Id=u;Password=***;"
    assert redact_value("BLOB", "https://a.blob.example/c?sv=2020&sig=abcDEF123%3D") == \
        "https://a.blob.example/c?sv=2020&sig=***"
    assert redact_value("DATABASE_URL", "postgres://app:hunter2@db:5432/x") == "postgres://***@db:5432/x"


def test_names_that_say_secret_in_other_words():
    for name in ("GITHUB_PAT", "DOCKER_AUTH_CONFIG", "AZURE_STORAGE_CONNECTION_STRING", "SSH_PASSPHRASE",
                 "SENTRY_DSN", "OPENAI_APIKEY"):
        assert redact_value(name, "plain-looking") == "***", name
    for name in ("GIT_AUTHOR_NAME", "PATH", "PYTHONPATH", "NCCL_IB_HCA", "OMP_NUM_THREADS"):
        assert redact_value(name, "/usr/bin:mlx5_0") == "/usr/bin:mlx5_0", name


def test_secret_arguments_are_masked_by_option_name_and_by_shape():
    from nodectl.secrets import redact_args

    args = ["train.py", "--hf-token", "abc123", "--api-key=plain", "--lr", "3e-4", "--note",
            "ghp_" + "A" * 36, "--db", "postgres://u:pw@h/db", "--max-grad-norm", "1.0", "--out", "dir"]
    assert redact_args(args) == ["train.py", "--hf-token", "***", "--api-key=***", "--lr", "3e-4", "--note", "***",
                                 "--db", "postgres://***@h/db", "--max-grad-norm", "1.0", "--out", "dir"]


def test_the_names_an_audit_found_leaking_are_redacted_and_ordinary_ones_kept():
    for name in ("DB_PASS", "MYSQL_PWD", "SMTP_PASS", "WANDB_KEY2", "SSH_KEYS", "db-pass"):
        assert redact_value(name, "hunter2") == "***", name
    for name in ("KEYBOARD_LAYOUT", "HF_HUB_OFFLINE", "NCCL_IB_HCA", "MASTER_PORT", "PYTHONPATH"):
        assert redact_value(name, "kept") == "kept", name
    assert redact_args(["--db-pass", "X", "--pass", "Y", "--lr", "1"]) == ["--db-pass", "***", "--pass", "***",
                                                                          "--lr", "1"]


@pytest.mark.parametrize("text", ["a" * 400_000, "a." * 200_000, "a://" * 100_000, "a:" * 200_000 + "//x"])
def test_redaction_is_linear_on_hostile_values(text):
    """The URL pattern once rescanned from every position (minutes for a 200 KB value). A 400 KB value is now one
    pass: far under the generous bound below on any machine, where a quadratic pattern takes minutes."""
    started = time.perf_counter()
    redact_text(text)
    redact_args([text])
    assert time.perf_counter() - started < 10


def test_short_p_is_a_password_unless_it_is_a_number():
    """`-p X` / `-pX` (mysql, mysqldump, sshpass): the audit's last leaking argument. A number stays (a port, a
    count): a script's command line with *** in it could not be replayed by --resume."""
    assert redact_args(["mysql", "-u", "root", "-p", "hunter2"]) == ["mysql", "-u", "root", "-p", "***"]
    assert redact_args(["mysqldump", "-phunter2", "db"]) == ["mysqldump", "-p***", "db"]
    assert redact_args(["serve.py", "-p", "8080", "--workers", "4"]) == ["serve.py", "-p", "8080", "--workers", "4"]
    assert redact_args(["serve.py", "-p8080"]) == ["serve.py", "-p8080"]
    assert redact_args(["train.py", "-p"]) == ["train.py", "-p"]   # nothing follows: nothing to hide


def test_the_probe_a_node_runs_is_one_script_that_masks_its_environment(tmp_path):
    """What a node's `python3 -` gets: probe.py with redaction.py's rules in place of its import (the node has no
    nodectl to import them from), run isolated from this tree; the environment it reports holds no secret."""
    import json
    import subprocess
    import sys

    from nodectl.remote.probe_nodes import probe_source

    source = probe_source()
    assert "\nfrom redaction import" not in source and source.count("def is_secret_name(") == 1
    token = TOKEN_SHAPES["Hugging Face"]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_TOKEN": token, "DB_PASS": "hunter2hunter2",
           "NOTE": f"see {TOKEN_SHAPES['GitHub classic PAT']}", "NCCL_SOCKET_IFNAME": "ens1"}
    done = subprocess.run([sys.executable, "-I", "-", str(tmp_path), "--no-import-torch"], input=source, env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert token not in done.stdout and "hunter2hunter2" not in done.stdout and "ghp_" not in done.stdout
    shown = json.loads(done.stdout.strip().splitlines()[-1])["env"]
    assert (shown["HF_TOKEN"], shown["DB_PASS"], shown["NOTE"], shown["NCCL_SOCKET_IFNAME"]) == ("***", "***", "***", "ens1")
