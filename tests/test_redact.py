from nodectl.secrets import redact_env, redact_value


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
