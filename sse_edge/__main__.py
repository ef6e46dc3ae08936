from sse_edge.service import main

main()
