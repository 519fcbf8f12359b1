"""tinker-cookbook 0.6.1's recipes against a real twinkle-server (`nox -s cookbook`, scripts/cookbook_recipes.py):
the server and each recipe's working folder (server.py), the recipe table (recipes.py), the local data
the recipes read in place of hub downloads (data.py), and the checks of the cookbook's capture/ and
weights/ libraries (capture_check.py, weights_check.py)."""
