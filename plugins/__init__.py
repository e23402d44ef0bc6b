"""Built-in plugins: default policies, TP mapping, PP slicing and MLA replication."""
