from infra.cli import main

main()
