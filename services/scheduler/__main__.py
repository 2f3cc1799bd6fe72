from academus.services.scheduler.server import main

main()
