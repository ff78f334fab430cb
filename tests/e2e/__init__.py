"""End-to-end runs: supervised jobs under ``spotrun run`` and torchrun, campaigns, deploy files, install."""
