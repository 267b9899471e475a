from fibctl.cli import main

main()
