from nodectl.cli import main

main(prog_name="nodectl")
