"""The model repository: models and versions on disk (`layout`) and the registry of those being served
(`registry`): loaded, routed to, swapped and unloaded live."""
