"""Applications built on the layers below: the main job, its data, advice."""
