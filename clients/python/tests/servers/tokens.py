"""The bearer tokens the end-to-end tests call with, and who each one is."""

TOKENS = {
    "tok-acme-fan": {"tenant": "acme", "sub": "fan-bot"},
    "tok-acme-typed": {"tenant": "acme", "sub": "typed-bot"},
    "tok-acme-outcomes": {"tenant": "acme", "sub": "outcomes-bot"},
    "tok-globex": {"tenant": "globex", "sub": "globex-bot"},
    "tok-initech": {"tenant": "initech", "sub": "initech-bot"},
    "tok-acme-spend": {"tenant": "acme", "sub": "spend-bot"},
}
