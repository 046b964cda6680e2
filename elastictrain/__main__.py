"""python -m elastictrain: the elastictrain command."""

from elastictrain.cli import main

main()
