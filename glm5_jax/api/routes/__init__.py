"""The API's routes, one module per endpoint group, each an APIRouter whose handlers take the app's
AppState (state.py) as a dependency: completions.py, chat.py, tokenize.py, models.py, health.py,
feedback.py. create_app (app.py) includes them; every router but health's behind the API-key and
drain checks."""
