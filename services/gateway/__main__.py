from academus.services.gateway.server import main

main()
