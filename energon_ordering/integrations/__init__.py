"""Thin modules, one per host training framework, that use the host's own flags, saver, loader
and file layout. The core never imports them; each imports its host lazily.
"""
