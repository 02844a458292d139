"""The tests' one set of helpers (docs/ARCHITECTURE.md, Tests): nodectl as a user runs it (cli.py), real sshd nodes
(sshcluster.py), projects and waits that fail loudly (launch.py), the trainer's runs (trainer.py), an S3 server
(s3server.py), container images (images.py), the installed wheel (wheelenv.py). Fixtures live in tests/conftest.py."""
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
