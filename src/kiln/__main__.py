"""`python -m kiln`: the same as the `kiln` command."""

from kiln.cli import main

if __name__ == "__main__":
    main()
