from academus.services.adapter_store.server import main

main()
