"""The online path of a speculative `generate` call: the decode loop (`loop`), one round of the
whole chain (`round`), the pure acceptance math (`acceptance`), and what the levels pass each
other (`protocol`)."""
