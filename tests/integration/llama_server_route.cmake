# llama_server_route: kvshare-serve with a real llama-server (LLAMA_SERVER=path, which
# scripts/test.sh builds from the pinned npm package) as the decoder, through the file route
# and every fallback. Exit 77 = skipped (no LLAMA_SERVER).
add_test(NAME llama_server_route
         COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/llama_server_route.py ${CMAKE_BINARY_DIR}/bin)
set_tests_properties(llama_server_route PROPERTIES TIMEOUT 900 SKIP_RETURN_CODE 77 LABELS llama_server)
