from kvp_cpp.ruler.cli import main

raise SystemExit(main())
