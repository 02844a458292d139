from nodectl.cli import run

run()
