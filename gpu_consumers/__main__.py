from gpu_consumers.service import main

main()
