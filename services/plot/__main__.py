from academus.services.plot.server import main

main()
