"""Actors: environment construction, the actor process and the supervised local actor processes. Imports ``core``,
``config`` and ``ops``; never learner code."""
