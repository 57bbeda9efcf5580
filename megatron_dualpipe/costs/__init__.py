"""What a schedule costs on a model, and which to use: the layer above the schedule IR and its
simulator. Standard library only, like ``schedule``."""
