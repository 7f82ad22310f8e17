from kvscope.cli import main

main()
