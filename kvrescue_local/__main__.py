"""`python3 -m kvrescue_local` is `kvrescue-local`."""

from .cli import main

main()
