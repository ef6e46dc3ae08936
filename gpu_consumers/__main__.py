from tokenbus.gpu_consumers.server import main

main()
