"""The content-addressed cache of exported programs, goldens and artifacts: its store, the keys
that name an entry, and the fingerprint of the code that shapes one."""
