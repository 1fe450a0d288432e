"""Small pure helpers for refusing bad input in good words (foundation): ``close_names`` (the
closest valid name to a misspelled one), ``text_checks`` (text entering from outside),
``validation_words`` (one pydantic error in a request's words).
"""
