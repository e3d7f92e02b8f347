"""`python3 -m kvrescue_local` is `kvrescue-local`."""

from .entry import main

main()
