"""The bad-input corpus: malformed requests, each with the reply it must get (see ``cases``)."""
