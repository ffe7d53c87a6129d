from qoqtool.cli import main

main()
