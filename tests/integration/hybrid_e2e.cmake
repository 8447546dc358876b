# hybrid_e2e: a generated model through kvshare-serve with the reference pair
# (kvshare-prefill, kvshare-decoder), file and shared routes, 32 concurrent requests; and
# with LLAMA_SERVER=path, a real llama-server on the file route. Exit 77 = skipped.
add_test(NAME hybrid_e2e
         COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/hybrid_e2e.py ${CMAKE_BINARY_DIR}/bin)
set_tests_properties(hybrid_e2e PROPERTIES TIMEOUT 600 SKIP_RETURN_CODE 77)
