from prefix_gateway.cli import main

main()
