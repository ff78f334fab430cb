"""Scripts the tests run as jobs: torchrun workers and fake launch commands (run as scripts, not
imported by spotrun; they import their neighbours, such as ``fakeckpt``, from their own directory)."""
