"""Views and actions over the whole cache: entries, gc, the directory overview, process reports and the panel's actions."""
