from tokenbus.sse_edge.server import main

main()
