from academus.services.worker.server import main

main()
