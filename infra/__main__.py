from tokenbus.infra.cli import main

main()
