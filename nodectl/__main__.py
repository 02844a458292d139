from nodectl.entry import main

main()
