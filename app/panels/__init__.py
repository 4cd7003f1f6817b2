"""One module per panel of the main window; each view wraps the Qt-free `RunState`."""
