"""The Tinker HTTP routes, one module per section; each ``build(...)`` returns its APIRouter."""
