from exporter.cli import main

main()
