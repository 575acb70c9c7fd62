"""The request registry: admission, each request's state table and mailbox, every ending."""
