from academus.services.resource_manager.server import main

main()
