from academus.services.trainer.server import main

main()
