"""Actors: environment construction, the actor process and the supervised local actor processes. Imports only
``core`` and ``ops``; never learner code."""
