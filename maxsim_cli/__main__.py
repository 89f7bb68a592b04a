from maxsim_cli.cli import main

main()
