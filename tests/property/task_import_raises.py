"""A task module that fails at import with something other than ImportError (the loader must name task.name)."""

raise RuntimeError("this module needs a GPU")
